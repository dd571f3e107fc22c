from omni_lightning.runner.loop import OmniPredictionLoop
from omni_lightning.runner.output import OmniModelRunnerOutput, build_pooler_output

__all__ = ["OmniModelRunnerOutput", "OmniPredictionLoop", "build_pooler_output"]
