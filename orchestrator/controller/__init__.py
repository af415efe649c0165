"""The controller daemon: leadership, agent sessions, the observe → decide → apply
reconcile loop and its executor, the operator service, the etcd store and metrics."""
