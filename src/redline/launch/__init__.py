"""`redline launch`: run a script on every GPU or machine through torch.distributed.run (torchrun)."""
