"""The command line, ``omni-lightning``: one room, files lowest first (``tests/test_layout.py`` checks it).

Before torch loads (standard library only, so a mistake costs a second):

- ``console``: what the command line prints (help, warnings in one line, the ``error:`` lines);
- ``help``: the short ``--help`` of a subcommand (the options it uses);
- ``arguments``: the command line and its config files read as plain data;
- ``path_checks``: the paths a command names (weights, output folder, timings file), checked;
- ``serve_options``: ``serve``'s own options and their values, checked before torch loads;
- ``preflight``: the whole command checked, and a predict job with nothing left to do ended.

Then, with torch and Lightning:

- ``lines``: what a run says as it starts, and the lines of Lightning's it says instead;
- ``fit``: what a fit adds (resuming, callbacks turned off, the line a stopped fit ends with);
- ``lightning_cli``: the LightningCLI over ``Code2WavModule``, ``CodesDataModule`` and the Trainer;
- ``serve``: ``omni-lightning serve``: the same options parsed, not run, and served (``serving/``);
- ``demo``: ``omni-lightning demo``: random weights, synthetic codes, the README's first run;
- ``entry``: ``main``: the subcommands, exit statuses, Ctrl-C and SIGTERM.

``main`` is the ``omni-lightning`` program; ``python -m omni_lightning.cli`` runs it too.
"""

from omni_lightning.cli.entry import main

__all__ = ["main"]
