"""The upstream index: mined from upstream's sources, reproducible, compact, and read token by
token.

The committed data is checked against the miner run on a pinned sample of upstream's own code
(SGLang 0.5.23's cache modules, installed by the README's test command); the C/C++ and Python
extractors against sources written here in the shapes upstream uses; the matcher and the
component map against lines and paths as reports carry them.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from signatures.index import DATA, load_index
from signatures.index.components import normalise
from signatures.index.failures import FailureKind, classify
from signatures.index.matcher import _sorted_unique
from signatures.index.model import Level, Provenance, read_system
from signatures.index.tokens import pieces, template_words, to_regex
from signatures.mine import cpp_src, python_src
from signatures.mine.build import extract_files, load_plan, merge

DATA_BUDGET = 3 << 20
"""The committed data files together, compressed."""


@pytest.fixture(scope="module")
def index():  # type: ignore[no-untyped-def]
    return load_index()


# --- the committed data ------------------------------------------------------------------------

def test_the_data_stays_within_its_budget_and_every_file_validates() -> None:
    files = sorted(DATA.glob("*.json.gz"))
    assert {p.name.removesuffix(".json.gz") for p in files} == {p.name for p in load_plan()}
    assert sum(p.stat().st_size for p in files) <= DATA_BUDGET
    for p in files:
        data = read_system(p)
        assert data.templates, p
        assert [v.version for v in data.versions] == list(
            next(s for s in load_plan() if s.name == data.system).versions)


def test_sglang_covers_every_release_from_the_first_with_hicache(index) -> None:  # type: ignore[no-untyped-def]
    versions = index.versions("sglang")
    assert versions[0] == "0.4.6"
    assert versions[-1] == "0.5.23"
    assert len(versions) >= 10
    srt = {t.file for t in index.templates if t.system == "sglang"}
    assert all(f.startswith("sglang/srt/") for f in srt)
    for system in ("lmcache", "mooncake", "torch", "gloo", "nccl", "nixl", "3fs", "vllm"):
        assert any(t.system == system for t in index.templates), system


def test_a_damaged_data_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.json.gz"
    bad.write_bytes(gzip.compress(b'{"format": 1, "system": "x"}'))
    with pytest.raises(ValueError, match="not a valid index file"):
        read_system(bad)
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="not a valid index file"):
        read_system(bad)
    rows = json.loads(gzip.decompress((DATA / "gloo.json.gz").read_bytes()))
    rows["templates"][0][1] = 10**6  # a file index out of range
    bad.write_bytes(gzip.compress(json.dumps(rows).encode()))
    with pytest.raises(ValueError, match="out of range"):
        read_system(bad).rows()


def _installed_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed (the README's test command installs 0.5.23)")
    version = importlib.metadata.version("sglang")
    if version != "0.5.23":
        pytest.skip(f"the pinned sample is SGLang 0.5.23, not {version}")
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_the_committed_index_is_what_the_miner_makes_of_a_pinned_sample(index) -> None:  # type: ignore[no-untyped-def]
    """The miner, run on SGLang 0.5.23's cache modules as installed, gives exactly the rows the
    committed index holds for 0.5.23 in those files (text, function, level, type, line)."""
    root = _installed_sglang()
    mem_cache = sorted(p for p in (root / "sglang" / "srt" / "mem_cache").rglob("*.py")
                       if "test" not in p.name)
    sample = [*mem_cache, root / "sglang/srt/managers/cache_controller.py"]
    files = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in sample]
    data = merge("sglang", [(Provenance(version="0.5.23", source="dir:sample"),
                             extract_files(files))])
    mined = {(t.text, t.file, t.function, t.level.value, t.exception, t.line)
             for t in data.rows()}
    paths = {path for path, _ in files}
    committed = {(t.text, t.file, t.function, t.level.value, t.exception, t.line)
                 for t in index.templates
                 if t.system == "sglang" and t.file in paths and "0.5.23" in t.versions}
    assert len(mined) > 1500
    assert mined == committed


def test_merging_is_deterministic_and_versions_become_a_mask() -> None:
    a = python_src.extract(b"def f():\n    raise ValueError('page pool went wrong')\n")
    b = python_src.extract(b"\n\ndef f():\n    raise ValueError('page pool went wrong')\n"
                           b"def g():\n    logger.error('only in the second release')\n")
    versions = [(Provenance(version="1", source="dir:x"), [("m.py", f) for f in a]),
                (Provenance(version="2", source="dir:x"), [("m.py", f) for f in b])]
    one, two = merge("x", versions), merge("x", versions)
    assert one.model_dump_json() == two.model_dump_json()
    rows = {r.text: r for r in one.rows()}
    assert rows["page pool went wrong"].versions == ("1", "2")
    assert rows["page pool went wrong"].line == 4  # the newest release's line
    assert rows["only in the second release"].versions == ("2",)


# --- extraction ------------------------------------------------------------------------------

PYTHON = b'''
import logging
logger = logging.getLogger(__name__)

class Pool:
    def alloc(self, n):
        assert n > 0
        assert self.free >= n, f"pool {self.name} has {self.free} pages, asked {n}"
        if n > 8:
            raise RuntimeError("cannot allocate %d pages from %s" % (n, self.name))
        logger.warning("pool at %.1f%% capacity", self.used * 100)
        logger.info("allocated %d pages", n)
        logger.debug("Failed to allocate memory for tensor(%s) because no memory is available", n)
        msg = f"{self.name} memory leak detected! "
        msg += f"free={self.free}"
        raise_error_or_warn(self, True, "leaks", msg)
        raise KeyError(n)
'''


def test_python_messages_become_templates() -> None:
    got = {(f.text, f.function, f.level, f.exception) for f in python_src.extract(PYTHON)}
    assert ("assert n > 0", "Pool.alloc", Level.ASSERT, "AssertionError") in got
    assert ("pool {*} has {*} pages, asked {*}", "Pool.alloc", Level.ASSERT,
            "AssertionError") in got
    assert ("cannot allocate {d} pages from {*}", "Pool.alloc", Level.EXCEPTION,
            "RuntimeError") in got
    assert ("pool at {f}% capacity", "Pool.alloc", Level.WARNING, "") in got
    # below warning only a failure is kept
    assert not any(t == "allocated {d} pages" for t, *_ in got)
    assert ("Failed to allocate memory for tensor({*}) because no memory is available",
            "Pool.alloc", Level.INFO, "") in got
    # a message built in a variable and handed to a reporting helper
    assert ("{*} memory leak detected! free={*}", "Pool.alloc", Level.ERROR, "") in got
    # nothing is made of a message with no text of its own
    assert not any(t.startswith("{*}") and len(t) < 6 for t, *_ in got)


CPP = r'''
// comments are not messages: LOG(ERROR) << "nope";
namespace mc {
enum class ErrorCode : int32_t { OK = 0, SEGMENT_NOT_FOUND = -101, RPC_TIMEOUT = -901 };

ErrorCode Client::Put(const std::string& key, size_t size) {
    if (size == 0) {
        LOG(ERROR) << "Failed to start put operation for key " << key
                   << ", size=" << size;
        return ErrorCode::INVALID_PARAMS;
    }
    CHECK_EQ(size % 4096, 0u) << "unaligned put";
    auto msg = c10::str("Watchdog caught collective operation timeout: ", key, " ran for ",
                        size, " milliseconds before timing out.");
    LOG(ERROR) << msg;
    GLOO_ENFORCE_LE(op.preamble.length, op.nbytes,
                    "Received data size doesn't match expected size.");
    WARN("NET/IB : Got completion with error %d, opcode %d", wc.status, wc.opcode);
    XLOGF(ERR, "Failed to read chunk {} from target {}", chunk, target);
    throw std::runtime_error("BatchGet failed for key '" + key + "'");
}
}  // namespace mc

// Vineyard src/client/io.cc connect_ipc_socket_retry: what goes to the error streams, and
// Arrow-style status builders
Status connect_ipc_socket_retry(const std::string& pathname, int& socket_fd) {
    std::clog << "[info] Connection to IPC socket failed for pathname " << pathname
              << " with ret = " << status << ", retrying " << n << " more times." << std::endl;
    std::cout << "ordinary output" << std::endl;
    return Status::ConnectionFailed("Failed to connect to IPC socket: " + pathname);
    return Status::OK();
}
'''


def test_cpp_messages_become_templates() -> None:
    got = {(f.text, f.function, f.level) for f in cpp_src.extract(CPP)}
    assert ("Failed to start put operation for key {*}, size={*}", "mc::Client::Put",
            Level.ERROR) in got or ("Failed to start put operation for key {*}, size={*}",
                                    "Client::Put", Level.ERROR) in got
    texts = {t for t, _, _ in got}
    assert "Check failed: size % 4096 == 0u ({*} vs. {*}) unaligned put" in texts
    assert ("Watchdog caught collective operation timeout: {*} ran for {*} milliseconds "
            "before timing out.") in texts
    assert ("op.preamble.length <= op.nbytes. {*} vs {*}. Received data size doesn't match "
            "expected size.") in texts
    assert "NET/IB : Got completion with error {d}, opcode {d}" in texts
    assert "Failed to read chunk {*} from target {*}" in texts
    assert "BatchGet failed for key '{*}'" in texts
    assert {"SEGMENT_NOT_FOUND", "RPC_TIMEOUT"} <= texts
    assert "nope" not in " ".join(texts)
    assert ("[info] Connection to IPC socket failed for pathname {*} with ret = {*}, retrying "
            "{*} more times.", "connect_ipc_socket_retry", Level.WARNING) in got
    raised = {(f.text, f.exception) for f in cpp_src.extract(CPP)}
    assert ("Failed to connect to IPC socket: {*}", "ConnectionFailed") in raised
    assert "ordinary output" not in texts


# --- templates and matching --------------------------------------------------------------------

def test_template_pieces_regex_and_tokens() -> None:
    t = "shape {*} is {{not}} {d}% of {f}"
    assert list(pieces(t)) == [("lit", "shape "), ("any", ""), ("lit", " is {not} "), ("d", ""),
                               ("lit", "% of "), ("f", "")]
    import re
    assert re.search(to_regex(t), "shape [3, 4] is {not} 12% of 0.5")
    assert template_words("Failed to allocate {*} pages") == ["fail", "to", "allocat", None,
                                                              "page"]
    assert template_words("failure allocating a page") == ["fail", "allocat", "page"]


def test_a_line_is_matched_to_the_template_that_printed_it(index) -> None:  # type: ignore[no-untyped-def]
    m = index.match("E1201 12:00:00.000 123 client_service.cpp:200] Failed to connect to master")
    assert m
    assert m[0].template.system == "mooncake"
    assert index.template_component(m[0].template).role == "storage"
    # one word changed (another release's wording) still matches, less strongly
    exact = index.match("No backup available on evicted nodes, should not happen")[0]
    changed = index.match("No backup available on evicted nodes, must not happen")[0]
    assert exact.template.id == changed.template.id
    assert changed.similarity < exact.similarity == 1.0


def test_a_misspelt_word_reads_as_the_word_one_edit_away_at_half_its_weight(index) -> None:  # type: ignore[no-untyped-def]
    # a Mooncake master's CHECK as one report quoted it, a digit for a letter (PR0CESSING):
    # the word no template has is read as the one word one edit away, weaker than the word
    line = "F0808 16:04:00.7 1 types.h:307] Check failed: status_ == ReplicaStatus::{} " \
           "(COMPLETE vs. PROCESSING)"
    exact = index.match(line.format("PROCESSING"))
    typo = index.match(line.format("PR0CESSING"))
    assert exact
    assert typo
    assert typo[0].template.id == exact[0].template.id
    assert typo[0].template.file == "mooncake-store/include/types.h"
    assert 0.7 <= typo[0].similarity < exact[0].similarity
    # swapped letters and a dropped one too
    right = index.match("No backup available on evicted nodes, should not happen")[0]
    for typo_line in ("No bakcup available on evicted nodes, should not happen",
                      "No backup avaliable on evicted nodes, should not happen",
                      "No backup available on evited nodes, should not happen"):
        assert index.match(typo_line)[0].template.id == right.template.id, typo_line
    # a word two edits from every template word is no word of theirs
    assert index.matcher._nearest("prxcexsing") == -1


def test_a_template_of_common_words_is_found_among_many_that_share_them(index) -> None:  # type: ignore[no-untyped-def]
    # vLLM 0.20.2 vllm/v1/kv_offload/cpu/manager.py: every word of "Block {} not found in
    # cache" is common, so hundreds of templates share some of them; it is reachable only
    # through its rarest word and must survive the cut to the candidates that get scored
    m = index.match("AssertionError: Block b'\\x03\\xc1XG0' not found in cache")
    assert m, "no reading"
    assert m[0].template.file.startswith("vllm/v1/kv_offload/")
    assert m[0].similarity == 1.0
    assert m[0].anchored


def test_a_template_that_fits_only_a_phrase_inside_the_line_is_not_anchored(index) -> None:  # type: ignore[no-untyped-def]
    # vLLM's "Error checking key existence: {}" fits the words in the middle of a Mooncake
    # connector's line; the reading says it does not account for the line's start
    line = ("Failed to get 6722 keys out of 6722. error_codes=[-707]. Check key existence and "
            "memory state.")
    assert all(not m.anchored for m in index.match(line))
    assert index.match("Error checking key existence: timeout")[0].anchored


def test_short_or_generic_templates_and_interpreter_messages_never_match(index) -> None:  # type: ignore[no-untyped-def]
    assert index.match("error handling callback was invoked with status -3") == []
    assert index.match("'NoneType' object has no attribute 'shape'") == []
    assert index.match("list index out of range") == []


def test_failure_kinds_come_from_upstream_wording() -> None:
    assert classify("Ref count of MemoryObj {*} is negative: {*}. Double free occurred",
                    Level.WARNING) is FailureKind.BOOKKEEPING
    assert classify("Failed to allocate memory for tensor {*}", Level.INFO) \
        is FailureKind.CAPACITY
    assert classify("shape {*} is invalid for input of size {*}", Level.EXCEPTION,
                    "RuntimeError") is FailureKind.SHAPE
    assert classify("Failed to connect to master", Level.ERROR) is FailureKind.IO
    assert classify("assert x > 0", Level.ASSERT, "AssertionError") is FailureKind.INVARIANT
    # an assertion on an object's type checks what the program was built with
    assert classify("assert isinstance(self.memory_allocator, MixedMemoryAllocator)", None,
                    "AssertionError") is FailureKind.CONFIG
    assert classify("type(pool) is HostKVPool", Level.ASSERT) is FailureKind.CONFIG
    assert classify("assert self.size == len(self.free) and isinstance(x, int)", None,
                    "AssertionError") is FailureKind.INVARIANT
    assert classify("pool at {f}% capacity", Level.WARNING) is None
    assert classify("RPC_TIMEOUT", Level.CODE) is FailureKind.TIMEOUT
    assert classify("SUCCESS", Level.CODE) is None


# --- the component map ---------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "component"), [
    ("/usr/local/lib/python3.12/dist-packages/sglang/srt/mem_cache/allocator.py", "cache.pool"),
    # the module became a package: the folder name still carries the meaning
    ("/sgl-workspace/sglang/python/sglang/srt/mem_cache/allocator/paged.py", "cache.pool"),
    ("python/sglang/srt/mem_cache/hiradix_cache.py", "cache.tree"),
    ("sglang/srt/managers/cache_controller.py", "cache.controller"),
    ("/opt/app/third_party/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py",
     "storage.mooncake"),
    ("client_service.cpp", "storage.mooncake"),  # a bare glog source site
    ("/root/vllm/vllm/v1/core/block_pool.py", "cache.tree"),
    ("/workspace/LMCache/lmcache/v1/memory_management.py", "cache.host-pool"),
    ("lmcache/v1/storage_backend/local_disk_backend.py", "storage.lmcache"),
    ("/srv/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "comm"),
    ("ProcessGroupNCCL.cpp", "comm"),
    ("/usr/lib/python3/site-packages/sglang/srt/disaggregation/mooncake/conn.py", "pd"),
    ("C:\\envs\\srv\\Lib\\site-packages\\vllm\\v1\\kv_offload\\cpu\\manager.py",
     "cache.host-pool"),
    # vLLM's simple CPU offloading (0.17 on), its own package beside kv_offload/
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/simple_kv_offload/manager.py",
     "cache.offload"),
    ("vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py",
     "cache.offload"),
    # device pools of a hardware backend (SGLang 0.5.20 hardware_backend/npu/)
    ("sglang/srt/hardware_backend/npu/memory_pool_npu.py", "cache.pool"),
    ("/workspace/LMCache/lmcache/v1/lazy_memory_allocator.py", "cache.host-pool"),
    # LMCache's local CPU "backend" is its host memory tier, whatever its folder says
    ("/usr/local/lib/python3.12/dist-packages/lmcache/v1/storage_backend/local_cpu_backend.py",
     "cache.host-pool"),
    # SGLang's Mooncake store module before it moved into a folder of its own
    ("/sgl-workspace/sglang/python/sglang/srt/mem_cache/mooncake_store.py", "storage.mooncake"),
])
def test_paths_map_to_components_wherever_they_are_installed(index, path: str,  # type: ignore[no-untyped-def]
                                                             component: str) -> None:
    comp = index.component(path)
    assert comp is not None, path
    assert comp.id == component, (path, comp)


def test_normalise_cuts_install_prefixes() -> None:
    assert normalise("/a/b/site-packages/foo/bar.py") == "foo/bar.py"
    assert normalise("/x/sglang/python/sglang/srt/y.py") == "sglang/srt/y.py"
    assert normalise("./relative/path.py") == "relative/path.py"


def test_the_cli_says_what_the_index_was_built_from() -> None:
    import json as _json

    from typer.testing import CliRunner

    from cli import app

    res = CliRunner().invoke(app, ["signatures", "sources", "--json"])
    assert res.exit_code == 0, res.output
    data = _json.loads(res.stdout)
    systems = {s["system"]: s for s in data["systems"]}
    assert systems["sglang"]["versions"][0]["source"] == "pypi:sglang==0.4.6"
    assert systems["mooncake"]["versions"][-1]["source"].startswith("git:kvcache-ai/Mooncake@")
    assert data["templates"] == sum(s["templates"] for s in data["systems"]) > 50000
    text = CliRunner().invoke(app, ["signatures", "sources"])
    assert text.exit_code == 0
    assert "upstream index" in text.stdout


def test_a_bare_assert_s_condition_matches_its_template_whole(index) -> None:  # type: ignore[no-untyped-def]
    # SGLang 0.5.23 mem_cache/allocator/swa.py: "assert self.x.available_size() <= self.x.size";
    # a report quotes the condition without "assert" and "self."
    m = index.match("swa_attn_allocator.available_size() <= swa_attn_allocator.size")
    assert m
    assert m[0].template.file.startswith("sglang/srt/mem_cache/allocator")
    assert m[0].similarity == 1.0


def test_a_bare_assert_s_words_in_a_line_that_asserts_nothing_are_not_its_report(index) -> None:  # type: ignore[no-untyped-def]
    # SGLang 0.5.2 memory_pool_host.py get_buffer_with_hash: "assert self.layout == 'page_first'";
    # a server-args echo holds the same words and compares nothing
    echo = ("server_args=ServerArgs(tp_size=4, enable_hierarchical_cache=True, "
            "hicache_mem_layout='page_first', hicache_storage_prefetch_policy='timeout')")
    assert not [m for m in index.match(echo, limit=8) if m.template.text.startswith("assert ")]
    quoted = index.match("assert self.layout == 'page_first'")
    assert quoted
    assert quoted[0].template.file.endswith("memory_pool_host.py")


def test_a_line_that_is_a_message_s_opening_sentence_matches_it_lower(index) -> None:  # type: ignore[no-untyped-def]
    # LMCache 0.3.6-0.5.6 storage_backend/local_cpu_backend.py LocalCPUBackend.allocate warns
    # "No eviction candidates found in local cpu backend. Local cpu memory is under pressure.
    # Waiting for {*} seconds before retrying."; a report may hold its first sentence only
    m = index.match("No eviction candidates found in local cpu backend.")
    assert m
    assert m[0].template.file == "lmcache/v1/storage_backend/local_cpu_backend.py"
    assert m[0].similarity == 0.75  # part of the message, not all of it
    assert index.match("No eviction candidates found in local cpu backend. Local cpu memory "
                       "is under pressure. Waiting for 2 seconds before retrying."
                       )[0].similarity == 1.0
    # a phrase that stops mid-sentence, or a word changed, is not the opening sentence
    assert index.match("No eviction candidates found in local cpu backend") == []
    assert index.match("No eviction candidates found in remote cpu backend.") == []
    # nor a short opening, which names too little
    assert index.match("No eviction candidates.") == []


def test_the_matcher_s_unique_is_numpy_s() -> None:
    """The sort-and-mask unique the matcher builds with gives ``np.unique``'s answer: empty,
    one element, negatives, repeats, and large random arrays."""
    rng = np.random.default_rng(7)
    cases = [np.zeros(0, dtype=np.int64), np.array([5], dtype=np.int64),
             np.array([3, -1, 3, 2, -1, 3], dtype=np.int64),
             *(rng.integers(-50, 10**12 if big else 40, n, dtype=np.int64)
               for n in (10, 1000, 200_000) for big in (False, True))]
    for x in cases:
        got, want = _sorted_unique(x), np.unique(x)
        assert got.dtype == want.dtype
        assert np.array_equal(got, want)
