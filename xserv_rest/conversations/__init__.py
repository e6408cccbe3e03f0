"""OpenAI's Conversations API (/v1/conversations): durable threads of items, in the same store
as responses; `conversation` on POST /v1/responses reads and extends one."""
