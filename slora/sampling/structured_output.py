"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or a
grammar. Data only; `slora.sampling.grammar` compiles it and masks the logits."""
from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """`spec` is the schema as JSON text (json_schema), the pattern (regex), the EBNF text (grammar), the
    strings (choice), or None (json_object)."""

    kind: StructuredKind
    spec: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "json_object":
            if self.spec is not None:
                raise ValueError("a json_object structured output takes no spec")
        elif self.kind == "choice":
            if not isinstance(self.spec, tuple) or not self.spec or \
                    not all(isinstance(c, str) and c for c in self.spec):
                raise ValueError("a choice structured output needs a non-empty tuple of non-empty strings")
        elif not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"a {self.kind} structured output needs its spec as a non-empty string")
