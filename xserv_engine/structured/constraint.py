"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a Lark grammar
or a choice among strings. Plain data, known to both the gRPC edge and the engine."""

from dataclasses import dataclass

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
GRAMMAR = "grammar"  # Lark, llguidance's dialect (%json{...}, <[token id]>)
CHOICE = "choice"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR, CHOICE)


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    # json_schema: the schema's JSON text; regex: the pattern; grammar: the Lark text;
    # choice: the allowed strings; json_object: unused
    spec: str | tuple[str, ...] = ""
    # JSON only: allow free whitespace between tokens. Off by default: a model may pad forever.
    whitespace_flexible: bool = False
    field: str = ""  # the request field named when it cannot compile; default: kind

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    @property
    def key(self) -> tuple:
        """Two constraints with the same key compile to the same grammar."""
        return (self.kind, self.spec, self.whitespace_flexible)

    @property
    def error_field(self) -> str:
        return self.field or self.kind
