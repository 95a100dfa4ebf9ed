import openai
from openai import OpenAI
c = OpenAI(base_url="http://127.0.0.1:41250/v1", api_key="x", max_retries=0)
msgs = [{"role": "user", "content": "x"}]
cases = {
 "stream_options=None": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, stream_options=None),
 "stream=None?": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, extra_body={"stream": None}),
 "n=None": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, n=None),
 "max_tokens=None": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, max_tokens=None),
 "stream_options include_usage None stream": lambda: list(c.chat.completions.create(model="qwen3.6:35b", messages=msgs, stream=True, stream_options={"include_usage": None})),
 "stream_options {} stream": lambda: list(c.chat.completions.create(model="qwen3.6:35b", messages=msgs, stream=True, stream_options={})),
 "legacy stream_options=None": lambda: c.completions.create(model="qwen3.6:35b", prompt="x", stream_options=None),
 "legacy best_of=3 n=2": lambda: c.completions.create(model="qwen3.6:35b", prompt="x", best_of=3, n=2),
 "legacy best_of=200": lambda: c.completions.create(model="qwen3.6:35b", prompt="x", best_of=200),
 "emb input []": lambda: c.embeddings.create(model="qwen3.6:35b", input=[]),
 "emb input [[]]": lambda: c.embeddings.create(model="qwen3.6:35b", input=[[]]),
 "emb input ''": lambda: c.embeddings.create(model="qwen3.6:35b", input=""),
 "legacy prompt []": lambda: c.completions.create(model="qwen3.6:35b", prompt=[]),
 "legacy prompt ''": lambda: c.completions.create(model="qwen3.6:35b", prompt="", max_tokens=2).choices[0].text,
 "modalities/audio passthrough": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, modalities=["text"], store=True, metadata={"a": "b"}).choices[0].message.content[:10],
 "web_search_options": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, web_search_options={}).choices[0].message.content[:10],
 "prediction": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, prediction={"type": "content", "content": "x"}).choices[0].message.content[:10],
 "max_completion_tokens": lambda: c.chat.completions.create(model="qwen3.6:35b", messages=msgs, max_completion_tokens=2).choices[0].message.content,
}
for name, f in cases.items():
    try:
        r = f(); print(f"{name}: OK {str(r)[:120]}")
    except openai.APIStatusError as e:
        print(f"{name}: {e.status_code} {e.body}")
    except Exception as e:
        print(f"{name}: RAISED {type(e).__name__} {e}")
