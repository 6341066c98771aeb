"""What the base model looks like to an adapter: its LoRA-targetable projections, their shapes and names."""
import re
from dataclasses import dataclass

_DOTTED_NAME = re.compile(r"\w+(?:\.\w+)*")


@dataclass(frozen=True)
class TargetShapes:
    """The model's LoRA layout: its layer count, and (in_features, out_features) of each targetable
    projection of a decoder layer, in the order of the adapter tables' module axis; and where those sit in
    the model's Hugging Face module names, which PEFT's patterns match and its tensor names hold: decoder
    layer i is `{layers_prefix}.{i}`, and module m is `module_paths[m]` inside it."""

    num_layers: int
    module_features: tuple[tuple[str, tuple[int, int]], ...]
    module_paths: tuple[str, ...]      # aligned with module_features, each ending in its module's name
    layers_prefix: str                 # "model.layers" for Llama

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not self.module_features:
            raise ValueError("a model has at least one layer and one LoRA-targetable module")
        modules = self.modules
        if len(set(modules)) != len(modules):
            raise ValueError(f"the LoRA-targetable modules {modules} repeat a name")
        if len(self.module_paths) != len(modules):
            raise ValueError(f"{len(self.module_paths)} module paths for the {len(modules)} modules {modules}")
        for module, path in zip(modules, self.module_paths):
            if not _DOTTED_NAME.fullmatch(path) or path.rsplit(".", 1)[-1] != module:
                raise ValueError(f"module path {path!r} is not a dotted name ending in its module's name {module!r}")
        if not _DOTTED_NAME.fullmatch(self.layers_prefix):
            raise ValueError(f"layers prefix {self.layers_prefix!r} is not a dotted name")

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of `module`, one of `modules`."""
        return dict(self.module_features)[module]

    def qualified_name(self, layer: int, module: str) -> str:
        """The model's name for `module` (one of `modules`) of decoder layer `layer`, as PEFT names it:
        `model.layers.3.self_attn.q_proj` for Llama."""
        return f"{self.layers_prefix}.{layer}.{dict(zip(self.modules, self.module_paths))[module]}"

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.module_features)
