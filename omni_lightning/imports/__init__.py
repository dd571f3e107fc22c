"""How the package imports what it needs, kept in one place because every room needs both, from ``data/`` up:

- ``lazy``: a package's public names imported on first use, so the command line checks its arguments
  before torch and Lightning load;
- ``torchaudio``: the one import of torchaudio; one that cannot load beside torch is a ``UsageError``
  naming the command that reinstalls both.

Standard library only here (this file imports neither).
"""
