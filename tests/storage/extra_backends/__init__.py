"""L3 backends written for tests, one module each; ``tests/storage/conftest.py`` imports every
module here, each registers itself, and the contract tests run on it like on a built-in."""
