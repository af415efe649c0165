"""The controller's decisions, as pure functions of ``(now, observed, spec)`` that
return an action and a reason: the job lifecycle, node remediation, operator
operations, adoption of ranks after a reconnect, placement, straggler scoring, hang
diagnosis and the guard rails. No I/O, no clock reads."""
