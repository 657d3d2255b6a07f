"""Structured outputs (guided decoding): grammar backends behind one interface.

`backend` defines the interface (`StructuredOutputBackend`, `StructuredOutputGrammar`), the spec
kinds (`StructuredOutputOptions`), backend selection (`create_backend`,
`resolve_auto_backend`) and logits masking (`apply_token_bitmask`); `backend_xgrammar` and
`backend_guidance` implement it with xgrammar and llguidance, which are imported only when a
backend of that kind is made or a spec is checked.
"""

from pagedinfer.structured_output.backend import (
    BackendName,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputKey,
    StructuredOutputOptions,
    StructuredOutputSpecError,
    apply_token_bitmask,
    bitmask_words,
    canonical_spec,
    create_backend,
    grammar_is_lark,
    resolve_auto_backend,
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
