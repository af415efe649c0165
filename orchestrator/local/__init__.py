"""``keel up``: a whole cluster on this machine (embedded etcd, controllers, agents),
the faults it injects, and the summary it prints."""
