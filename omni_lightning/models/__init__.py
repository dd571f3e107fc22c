from omni_lightning.models.code2wav import Code2Wav, Code2WavConfig, randomize_weights, validate_codes

__all__ = ["Code2Wav", "Code2WavConfig", "randomize_weights", "validate_codes"]
