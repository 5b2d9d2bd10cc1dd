"""Data files of the console (a package so that the wheel ships them): uPlot, its chart
library, with its MIT licence (``uPlot.LICENSE``) and version (``uPlot.version``), kept in git
and replaced by ``scripts/update-uplot VERSION``."""
