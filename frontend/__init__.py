"""The API process: aiohttp (on uvloop) serving OpenAI's completions and chat completions.

It tokenizes and validates requests, hands them to the scheduler over ZeroMQ, and detokenizes
the tokens that come back. It never imports torch.
"""
