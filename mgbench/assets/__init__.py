"""Models and datasets: the alias registry and offline loading, dataset configs, needle fillers."""
