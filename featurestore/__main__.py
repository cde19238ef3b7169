"""``python -m featurestore``: the same CLI as the ``featurestore`` command."""

from featurestore.cli import main

main()
