"""Files read and written without following what an agent planted (links, FIFOs,
devices, paths that change under us): ``safefs.py`` opens and walks, ``safeglob.py``
matches globs on the walked tree."""
