"""autotune: SLO-aware auto-tuning of vLLM deployments."""

from autotune.core.records import RequestRecord
from autotune.core.slo import SLO, Limit, parse_slo

__all__ = ["SLO", "Limit", "RequestRecord", "parse_slo"]
__version__ = "0.1.0"
