"""Memory-lean optimizer recipes: bfloat16 moments and params with stochastic rounding, param remainders, 8-bit and 4-bit moments.

Each is an optax transformation to wrap in [`jaxmp.loss_scaling`][jaxmp.loss_scaling]:
[`bf16_moments`][jaxmp.lean.bf16_moments] (bfloat16 moments), [`quantized_moments`][jaxmp.lean.quantized_moments]
(8-bit or 4-bit blockwise moments), [`bf16_params`][jaxmp.lean.bf16_params]
(bfloat16 params, no master), [`param_remainders`][jaxmp.lean.param_remainders] (a float32 master
as a bfloat16 param plus 16 bits) and [`preset`][jaxmp.lean.preset] (the combinations by name).
Why round stochastically, where the random bits come from and what a skipped step draws:
see docs/lean-recipes.md.

One private module per recipe: ``_bf16`` (bfloat16 moments and params, stochastic rounding),
``_remainders`` (param remainders), ``_quantized`` (8-bit and 4-bit moments, updated a slice at a
time by ``_chunked``) and ``_presets`` (the presets' table of records); ``_widening`` is what the
param recipes share with what they wrap.
"""

from jaxmp.lean._bf16 import Bf16MomentsState, Bf16ParamsState, bf16_moments, bf16_params, stochastic_round
from jaxmp.lean._presets import PRESETS, preset
from jaxmp.lean._quantized import QuantizedMomentsState, quantized_moments
from jaxmp.lean._remainders import ParamRemaindersState, merge_master, param_remainders, remainder_master, \
    split_master

__all__ = [
    "Bf16MomentsState",
    "Bf16ParamsState",
    "ParamRemaindersState",
    "PRESETS",
    "QuantizedMomentsState",
    "bf16_moments",
    "bf16_params",
    "merge_master",
    "param_remainders",
    "preset",
    "quantized_moments",
    "remainder_master",
    "split_master",
    "stochastic_round",
]
