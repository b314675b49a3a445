"""The cluster and its processes, in the notebook's kernel: nbfsdp's own cluster on this machine, an attached one
across hosts, the fork server, the reaper's arming, and ipyparallel's private APIs behind one module.
"""
