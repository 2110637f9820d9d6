"""Mixtral glue (transformers 4.44.2): Mistral's attention (q_proj / k_proj / v_proj, rotate_half RoPE) with
its rotary module called with a length (`LengthRopeGlue`); the MoE MLP is not ours to touch.

Sliding window: 4.44.2 applies config.sliding_window under flash_attention_2 alone (every layer); eager and
sdpa attend over everything (Llama's causal mask). Its experts (block_sparse_moe.experts.*) have no place for
another family's MLP weights: load_model's model_class refuses them.
"""

from dataclasses import dataclass

from transformers.models.mixtral import modeling_mixtral

from pyramidkv.models.glue import flash_windows
from pyramidkv.models.rope import LengthRopeGlue


@dataclass(frozen=True, kw_only=True)
class MixtralGlue(LengthRopeGlue):
    def layer_windows(self, config, implementation="eager"):
        return flash_windows(config, implementation)


GLUE = MixtralGlue(
    causal_lm=modeling_mixtral.MixtralForCausalLM,
    attention_classes=(modeling_mixtral.MixtralAttention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_mixtral.apply_rotary_pos_emb,
)
