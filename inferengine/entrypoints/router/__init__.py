"""`inferengine router`: one OpenAI endpoint over prefill engines and decode engines (issue [24])."""
