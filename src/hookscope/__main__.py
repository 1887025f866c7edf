"""``python -m hookscope`` runs the command line (also under ``torchrun -m hookscope``)."""

from hookscope.cli import main

main()
