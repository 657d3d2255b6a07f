"""Structured outputs (guided decoding): grammar backends behind one interface.

`specs` defines the spec kinds (`StructuredOutputOptions`) and the spec parsing the backends
share; `backend` defines the interface (`StructuredOutputBackend`, `StructuredOutputGrammar`),
backend selection (`create_backend`, `resolve_auto_backend`) and logits masking
(`apply_token_bitmask`); `backend_xgrammar` and `backend_guidance` implement it with xgrammar
and llguidance, which are imported only when a backend of that kind is made or a spec is
checked.
"""

from pagedinfer.structured_output.backend import (
    BackendName,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    apply_token_bitmask,
    bitmask_words,
    create_backend,
    resolve_auto_backend,
)
from pagedinfer.structured_output.specs import (
    StructuredOutputKey,
    StructuredOutputOptions,
    StructuredOutputSpecError,
    canonical_spec,
    grammar_is_lark,
)

__all__ = [
    "BackendName",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputKey",
    "StructuredOutputOptions",
    "StructuredOutputSpecError",
    "apply_token_bitmask",
    "bitmask_words",
    "canonical_spec",
    "create_backend",
    "grammar_is_lark",
    "resolve_auto_backend",
]
