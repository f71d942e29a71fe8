"""The ``--method`` names, apart from the engine so that the command line's parsers are built without torch."""

METHODS = ("ar", "early-exit", "draft-model", "prompt-lookup", "eagle", "eagle-lookup", "rsd-c", "rsd-s", "specinfer")
TREE_METHODS = ("rsd-c", "rsd-s", "specinfer")
