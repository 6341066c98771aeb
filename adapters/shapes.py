"""What the base model looks like to an adapter: which projections exist and their shapes."""
from dataclasses import dataclass

from slora.kernels.layout import LORA_MODULES


@dataclass(frozen=True)
class TargetShapes:
    """In/out features of each LoRA-targetable projection of one decoder layer, and the layer count."""

    num_layers: int
    hidden_size: int
    q_size: int          # num_heads * head_dim
    kv_size: int         # num_kv_heads * head_dim
    intermediate_size: int

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of `module`, one of LORA_MODULES."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        table = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return table[module]

    @property
    def modules(self) -> tuple[str, ...]:
        return LORA_MODULES
