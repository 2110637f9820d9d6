"""Qwen2 glue (Qwen2 and Qwen2.5 checkpoints, transformers 4.44.2): the rotate_half family, its rotary module
called with a length (`LengthRopeGlue`); q_proj / k_proj / v_proj carry their biases inside the Linear modules.

Sliding window: the config's sliding_window is set only with use_sliding_window (off in Qwen2.5's configs);
4.44.2 applies it under flash_attention_2 alone, on layers from max_window_layers on; eager and sdpa attend
over everything (docs/models.md, "Qwen2, Phi-3 and Mixtral").
"""

from dataclasses import dataclass

from transformers.models.qwen2 import modeling_qwen2

from pyramidkv.models.glue import flash_windows
from pyramidkv.models.rope import LengthRopeGlue


@dataclass(frozen=True, kw_only=True)
class Qwen2Glue(LengthRopeGlue):
    def layer_windows(self, config, implementation="eager"):
        if not getattr(config, "use_sliding_window", False):
            return (None,) * config.num_hidden_layers
        return flash_windows(config, implementation, first_layer=config.max_window_layers)


GLUE = Qwen2Glue(
    causal_lm=modeling_qwen2.Qwen2ForCausalLM,
    attention_classes=(modeling_qwen2.Qwen2Attention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_qwen2.apply_rotary_pos_emb,
    # settings of another family's config that Qwen2's eager / sdpa attention does not apply (load_model refuses
    # weights it has no place for: o_proj or MLP biases; the q/k/v biases a Llama checkpoint lacks start at zero)
    refused_settings=("rope_scaling", "sliding_window"),
)
