"""Files `rdepth export --remote-code` writes next to a model; they import torch and transformers only."""
