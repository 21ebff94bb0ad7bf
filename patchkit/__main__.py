"""``python -m patchkit``: the same CLI as the ``patchkit`` command."""

from patchkit.cli import main

main()
