"""OpenAI's Responses API (POST /v1/responses): one more adapter over the generation core."""
