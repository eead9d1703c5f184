"""The official `openai` package against the kvmesh gateway: chat and completions, streaming and not."""
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = "deepseek-v4"

chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
assert chat.choices[0].message.content, chat
assert chat.usage.prompt_tokens > 0, chat.usage

parts = []
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count."}], max_tokens=8, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
assert parts, "no streamed chat content"

comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
assert comp.choices[0].text, comp

streamed = [c.choices[0].text for c in client.completions.create(model=model, prompt=[1000, 2000, 3000], max_tokens=8, stream=True) if c.choices]
assert "".join(streamed), "no streamed completion text"

models = client.models.list()
assert any(m.id == model for m in models.data), models
print("openai client ok")
