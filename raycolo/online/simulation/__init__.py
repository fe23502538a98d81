"""The online simulator: a discrete-event clock driving the same schedulers as the live
runtime, and sweeps over policies and rates (no Ray).
"""
