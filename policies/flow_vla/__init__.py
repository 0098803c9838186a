"""Flow-matching VLA policy: config, model, samplers, uncertainty scores.

Time convention everywhere: t = 0 noise, t = 1 data (see :mod:`.conventions` for openpi conversions).
"""

from .configuration_flow_vla import ConfigError, FlowVLAConfig
from .conventions import from_openpi_time, to_openpi_time, velocity_from_openpi, velocity_to_openpi
from .encoders import embed_instructions
from .modeling_flow_vla import DenoisingChain, FlowSample, FlowVLAPolicy, PrefixCache
from .normalize import Normalizer, compute_normalization_stats
from .sampling import (
    SampleResult,
    SDESchedule,
    chain_log_prob,
    euler_sample,
    learnable_noise_sample,
    sde_sample,
)
from .uncertainty import accel_score, straightness

__all__ = [
    "ConfigError",
    "DenoisingChain",
    "FlowSample",
    "FlowVLAConfig",
    "FlowVLAPolicy",
    "Normalizer",
    "PrefixCache",
    "SDESchedule",
    "SampleResult",
    "accel_score",
    "chain_log_prob",
    "compute_normalization_stats",
    "embed_instructions",
    "euler_sample",
    "from_openpi_time",
    "learnable_noise_sample",
    "sde_sample",
    "straightness",
    "to_openpi_time",
    "velocity_from_openpi",
    "velocity_to_openpi",
]
