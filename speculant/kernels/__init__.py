"""Our own CPU kernels, where torch has none that is fast on the machine at hand (see :mod:`.qgemm`)."""
