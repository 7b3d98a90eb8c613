"""The benchmark harness behind `metrale bench`: workloads, the offline and serving drivers,
single-request latency, engine overhead, the roofline, and the peers run on the same weights.

Nothing here is imported by the engine; its extra dependencies are the `bench` extra.
"""
