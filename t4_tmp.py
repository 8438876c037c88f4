import jax, jax.numpy as jnp, time, jaxmp, optax
from jaxmp.diagnostics._shadow import compare_to_float32
def loss(p, x, y):
    with jax.named_scope("encoder"):
        h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("sched"):
        gamma = h @ p["ws"] + p["bs"]
    with jax.named_scope("head"):
        out = h @ p["w2"]
    pred = out * jnp.exp(gamma - 13.0)
    return jnp.mean((pred - y) ** 2)
k = jax.random.split(jax.random.key(0), 5)
x = jax.random.normal(k[0], (64, 16))
p = {"w1": jax.random.normal(k[1], (16, 32)) / 4, "ws": jax.random.normal(k[2], (32, 1)) * 0.01,
     "bs": jnp.full((1,), 13.3), "w2": jax.random.normal(k[3], (32, 1)) / 6}
true = dict(p, bs=jnp.full((1,), 13.33), w2=p["w2"] * 1.1)
def fwd(p, x):
    h = jnp.tanh(x @ p["w1"]); return (h @ p["w2"]) * jnp.exp(h @ p["ws"] + p["bs"] - 13.0)
y = fwd(true, x)
t = time.time(); r = compare_to_float32(loss, p, x, y, policy="O2-bf16", per_op=True); print(time.time() - t)
print(r)
t = time.time(); r = compare_to_float32(loss, p, x, y, policy="O2-bf16", steps=50, optimizer=optax.adam(2e-3)); print(time.time() - t)
print(r)
