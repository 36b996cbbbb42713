"""parallel3d: Megatron-style 3D-parallel training for PyTorch."""
__version__ = "0.1.0"
