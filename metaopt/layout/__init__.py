"""The hybrid layout of a job: the topology (each worker's coordinate), its process groups and
the rank arithmetic. Below fleet, passes and runtime, which import it; it imports none of them."""
