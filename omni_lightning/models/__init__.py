from omni_lightning.models.code2wav import Code2Wav
from omni_lightning.models.codes import validate_codes
from omni_lightning.models.config import Code2WavConfig, resolve_config
from omni_lightning.models.random_weights import randomize_weights
from omni_lightning.models.streaming import StreamingDecoder

__all__ = ["Code2Wav", "Code2WavConfig", "randomize_weights", "resolve_config", "StreamingDecoder", "validate_codes"]
