"""Typed configuration for a whole run: TOML files plus dotted command-line overrides.

`schema.py` declares every field once (type, limits, doc, default); `loading.py` turns a file and overrides into
a checked Config; `reference.py` writes a Config as TOML and renders the README's tables; `base.py` holds what
the sections share (limits, error paths). Import everything from here: `from pipeline.config import Config`.
"""

from pipeline.config.base import ConfigError, key_path
from pipeline.config.loading import apply_overrides, from_dict, load_config
from pipeline.config.reference import dumps_toml, reference_markdown, to_toml_dict, update_readme
from pipeline.config.schema import (
                                    BufferConfig,
                                    Config,
                                    DataConfig,
                                    EndpointsConfig,
                                    EngineConfig,
                                    EvalConfig,
                                    LearnerConfig,
                                    ModelConfig,
                                    ProducersConfig,
                                    RunConfig,
                                    SamplingConfig,
                                    WeightsConfig,
)

__all__ = [
    "BufferConfig", "Config", "ConfigError", "DataConfig", "EndpointsConfig", "EngineConfig", "EvalConfig",
    "LearnerConfig", "ModelConfig", "ProducersConfig", "RunConfig", "SamplingConfig", "WeightsConfig",
    "apply_overrides", "dumps_toml", "from_dict", "key_path", "load_config", "reference_markdown", "to_toml_dict",
    "update_readme",
]
