"""Diagnostics: where does mixed precision help, and where could it hurt?

* [`precision_report`][jaxmp.diagnostics.precision_report.precision_report] -- dtypes, FLOPs and Tensor-Core eligibility of every matmul and
  convolution of a (jitted) step, read off its jaxpr; risky and missed half-precision ops.
* [`gradient_stats`][jaxmp.diagnostics.gradient_stats.gradient_stats] -- log2|g| histograms per parameter group and float16
  underflow/overflow fractions at a loss scale; a suggested static scale; a PNG plot.
* [`input_pipeline_overhead`][jaxmp.diagnostics.input_pipeline_overhead] -- exposed data-loading time and the speed-up cap it implies.
* the precision debugger ([When half precision goes wrong](../debugging.md)): `locate_non_finite` names the first op that
  made inf/NaN from finite inputs; `compare_to_float32` ranks modules by the error of a
  float32 shadow run and writes the override that fixes the top one; `strict_precision`
  raises where a float32-list op runs in half outside autocast.

Modules: ``precision_report`` (the report), ``jaxpr_walk`` (finding ops in a jaxpr and its
sub-jaxprs), ``_matmul`` (GEMM geometry and FLOPs), ``gradient_stats``, ``input_pipeline`` and
``_format`` (tables); the debugger's ``_evaluate`` (op-by-op re-evaluation), ``_locate``,
``_shadow``, ``_fix`` and ``_strict``. None of them imports matplotlib, rich or TensorFlow at import time.
"""

from jaxmp import _deprecations
from jaxmp.diagnostics.autocast_ops import AutocastOp
# Not public (report.explain() reads it); bound here because its module has the same name.
from jaxmp.diagnostics.autocast_ops import autocast_ops
from jaxmp.diagnostics.gradient_stats import GradientStats
from jaxmp.diagnostics.gradient_stats import GroupStats
from jaxmp.diagnostics.gradient_stats import gradient_stats
from jaxmp.diagnostics.input_pipeline import PipelineOverhead
from jaxmp.diagnostics.input_pipeline import input_pipeline_overhead
from jaxmp.diagnostics.precision_report import MatmulOp
from jaxmp.diagnostics.precision_report import PrecisionReport
from jaxmp.diagnostics.precision_report import RiskyOp
from jaxmp.diagnostics.precision_report import precision_report
from jaxmp.diagnostics._locate import NonFiniteCulprit
from jaxmp.diagnostics._locate import locate_non_finite
from jaxmp.diagnostics._shadow import Fix
from jaxmp.diagnostics._shadow import ModuleError
from jaxmp.diagnostics._shadow import ShadowReport
from jaxmp.diagnostics._shadow import compare_to_float32
from jaxmp.diagnostics._strict import StrictPrecisionError
from jaxmp.diagnostics._strict import strict_precision

__all__ = [
    "precision_report", "PrecisionReport", "MatmulOp", "RiskyOp", "AutocastOp",
    "gradient_stats", "GradientStats", "GroupStats",
    "input_pipeline_overhead", "PipelineOverhead",
    "locate_non_finite", "NonFiniteCulprit", "compare_to_float32", "ShadowReport",
    "strict_precision", "StrictPrecisionError",
]

__getattr__ = _deprecations.module_getattr(__name__)
