"""Diagnostics: where does mixed precision help, and where could it hurt?

`precision_report` (dtypes, FLOPs, Tensor-Core eligibility of every matmul), `gradient_stats`
(float16 underflow/overflow at a loss scale), `input_pipeline_overhead` (exposed data time) and
the precision debugger (`locate_non_finite`, `compare_to_float32`, `strict_precision`).
See docs/diagnostics.md and docs/debugging.md.
"""

from jaxmp.diagnostics._autocast_ops import AutocastOp
# Not public (report.explain() reads it); bound here because its module has the same name.
from jaxmp.diagnostics._autocast_ops import autocast_ops as autocast_ops
from jaxmp.diagnostics._gradient_stats import GradientStats
from jaxmp.diagnostics._gradient_stats import GroupStats
from jaxmp.diagnostics._gradient_stats import gradient_stats
from jaxmp.diagnostics._input_pipeline import PipelineOverhead
from jaxmp.diagnostics._input_pipeline import input_pipeline_overhead
from jaxmp.diagnostics._precision_report import MatmulOp
from jaxmp.diagnostics._precision_report import PrecisionReport
from jaxmp.diagnostics._precision_report import RiskyOp
from jaxmp.diagnostics._precision_report import precision_report
from jaxmp.diagnostics._locate import NonFiniteCulprit
from jaxmp.diagnostics._locate import locate_non_finite
from jaxmp.diagnostics._block_report import block_report
# The rows of a ShadowReport (its API page documents them), outside the counted surface.
from jaxmp.diagnostics._fix import Fix as Fix
from jaxmp.diagnostics._shadow_report import ModuleError as ModuleError
# What compare_to_float32(choose=...) returns, its rows, its verification and its prediction (documented on
# the API page), uncounted too.
from jaxmp.diagnostics._choose import ModuleRung as ModuleRung
from jaxmp.diagnostics._choose import PrecisionPlan as PrecisionPlan
from jaxmp.diagnostics._cost import SpeedupPrediction as SpeedupPrediction
from jaxmp.diagnostics._verify import Verification as Verification
from jaxmp.diagnostics._shadow_report import ShadowReport
from jaxmp.diagnostics._shadow import compare_to_float32
from jaxmp.diagnostics._strict import StrictPrecisionError
from jaxmp.diagnostics._strict import strict_precision

__all__ = [
    "precision_report", "PrecisionReport", "MatmulOp", "RiskyOp", "AutocastOp",
    "gradient_stats", "GradientStats", "GroupStats",
    "input_pipeline_overhead", "PipelineOverhead",
    "locate_non_finite", "NonFiniteCulprit", "compare_to_float32", "ShadowReport",
    "strict_precision", "StrictPrecisionError", "block_report",
]
