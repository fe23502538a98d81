"""Ray Serve: the OpenAI-compatible FastAPI ingress, its launcher, metrics and the channel
to the online controller.
"""
