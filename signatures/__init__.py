"""The versioned catalog of known HiCache crash signatures.

Data lives in ``signatures/catalog/*.yaml`` (one file per signature, plus shared log patterns and
frame rules); :mod:`signatures.models` is its schema, :mod:`signatures.loader` reads it,
:mod:`signatures.fact_names` is the vocabulary of structural facts the doctor derives, and
:mod:`signatures.matching` scores an observation against every signature with a rule log.
This package imports neither torch nor rich.
"""

from signatures.fact_names import Fact
from signatures.loader import load_catalog
from signatures.models import Catalog, Signature

__all__ = ["Catalog", "Fact", "Signature", "load_catalog"]
