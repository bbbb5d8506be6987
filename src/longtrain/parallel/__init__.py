"""Multi-process execution: layer groups over a torch.distributed process group."""
