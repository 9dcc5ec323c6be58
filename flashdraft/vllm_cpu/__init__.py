"""Runtime fixes for vLLM's CPU build, loaded in the vLLM processes flashdraft starts (sitecustomize.py beside this);
nothing of flashdraft imports this package."""
