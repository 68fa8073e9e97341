"""Talk to `specd serve api_server` with the OpenAI client (the seed's client example)."""

import sys

from openai import OpenAI

if __name__ == '__main__':
    port = sys.argv[1] if len(sys.argv) > 1 else '23333'
    client = OpenAI(api_key='YOUR_API_KEY', base_url=f'http://0.0.0.0:{port}/v1')
    model_name = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model_name,
        messages=[
            {'role': 'system', 'content': 'You are a helpful assistant.'},
            {'role': 'user', 'content': 'def fibonacci(n):'},
        ],
        temperature=0,
        max_tokens=64,
    )
    print('completion:', repr(response.choices[0].message.content))
    stats = (response.model_extra or {}).get('spec_stats') or {}
    print('acceptance: mean length {:.2f} (bonus counted), rate {:.2f}, drafts {}, accepted per position {}'.format(
        stats.get('mean_acceptance_length', 1.0), stats.get('acceptance_rate', 0.0),
        stats.get('num_drafts', 0), stats.get('accepted_per_position', [])))
