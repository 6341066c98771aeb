"""What the base model looks like to an adapter: its LoRA-targetable projections and their shapes."""
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetShapes:
    """The model's LoRA layout: its layer count, and (in_features, out_features) of each targetable
    projection of a decoder layer, in the order of the adapter tables' module axis."""

    num_layers: int
    module_features: tuple[tuple[str, tuple[int, int]], ...]

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not self.module_features:
            raise ValueError("a model has at least one layer and one LoRA-targetable module")

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of `module`, one of `modules`."""
        return dict(self.module_features)[module]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.module_features)
