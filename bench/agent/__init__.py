"""`mlxd bench`: closed-loop agent and chat load against OpenAI-compatible servers, mlxd and its peers."""
