from omni_lightning.runner.loop import OmniPredictionLoop
from omni_lightning.runner.output import MultimodalOutputs, OmniModelRunnerOutput, build_pooler_output

__all__ = ["MultimodalOutputs", "OmniModelRunnerOutput", "OmniPredictionLoop", "build_pooler_output"]
