"""Models (the math), their configs, checkpoint loading. Import submodules directly: this package
stays free of torch imports so that torch-less processes can read model configs."""
