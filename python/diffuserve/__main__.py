"""python -m diffuserve: the diffuserve command."""
from .cli import main

main()
