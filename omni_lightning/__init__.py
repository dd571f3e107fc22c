"""omni_lightning: the Code2Wav stage of omni speech models in PyTorch Lightning."""

from omni_lightning.models.code2wav import Code2Wav, Code2WavConfig, randomize_weights, validate_codes

__version__ = "0.1.0"

__all__ = ["Code2Wav", "Code2WavConfig", "randomize_weights", "validate_codes"]
