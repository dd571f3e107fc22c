"""``omni-lightning serve``: a Code2Wav behind HTTP and WebSocket (FastAPI + uvicorn), every client batched into
one decode loop's steps, every response exactly ``decode`` of its codes. The ``serve`` extra installs it
(``pip install "omni-lightning[serve]"``); ``import omni_lightning`` does not import this package.

- ``build_app(module, max_streams=...)``: the app over a ``Code2WavModule`` (fine-tuned in this process, or
  loaded) or a ``Code2Wav``, on its device and dtype (``app.py``);
- ``server_for(app, host, port)``: uvicorn's server with a drain on SIGTERM (``server.py``).
"""

from omni_lightning.serving.app import build_app
from omni_lightning.serving.server import DrainingServer, server_for

__all__ = ["build_app", "server_for", "DrainingServer"]
